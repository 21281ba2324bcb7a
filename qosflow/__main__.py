import sys

from qosflow.cli.main import main

sys.exit(main())
