from p2pnode.cli import main

raise SystemExit(main())
