"""``python -m pagedkv.cli``: the ``pagedkv`` command."""

import sys

from . import main

sys.exit(main())
