from harts.cli.main import main

raise SystemExit(main())
