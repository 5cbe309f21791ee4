from dspark_calib.cli.app import main

main()
