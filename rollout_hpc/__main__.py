from rollout_hpc.cli import main

raise SystemExit(main())
