import sys

from streamrt.parallel.launch import main

if __name__ == "__main__":
    sys.exit(main())
