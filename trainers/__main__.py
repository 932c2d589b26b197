import sys

from trainers.launch.cli import main

sys.exit(main())
