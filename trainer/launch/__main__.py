"""``python -m trainer.launch``: ps-launch."""

import sys

from . import main

sys.exit(main())
