import sys

from moestream.cli import main

sys.exit(main())
