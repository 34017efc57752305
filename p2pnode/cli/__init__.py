"""The command line: argument parsing, dispatch and exit codes, and output rendering."""
