"""`python -m hf_fp8kv compare ...`: the same as the `hf-fp8kv` command."""

from hf_fp8kv.cli import main

raise SystemExit(main())
