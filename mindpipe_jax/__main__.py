"""``python -m mindpipe_jax`` runs the ``mindpipe`` command line."""

import sys

from mindpipe_jax.cli import main

sys.exit(main())
