from p2pnode.cli.main import run

run()
