from ate_bench.cli import main

raise SystemExit(main())
