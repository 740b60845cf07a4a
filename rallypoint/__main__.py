from rallypoint._cli import main

raise SystemExit(main())
