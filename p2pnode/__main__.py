from p2pnode.cli.main import main

raise SystemExit(main())
