from kvforge.cli import main

raise SystemExit(main())
