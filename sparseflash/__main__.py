from sparseflash.cli import main

raise SystemExit(main())
