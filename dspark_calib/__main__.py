from dspark_calib.cli import main

main()
