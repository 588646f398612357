from rlaif.cli import main

raise SystemExit(main())
