from opalctl.cli import main

main()
