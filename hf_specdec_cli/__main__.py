"""`python -m hf_specdec_cli`: the `hf-specdec` command."""

import sys

from . import main

sys.exit(main())
