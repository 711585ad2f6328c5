from .service._cli import main

raise SystemExit(main())
