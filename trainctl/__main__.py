from trainctl.cli.app import main

main()
