import sys

try:  # Ctrl-C while Linnet itself is still importing is one line too
    from linnet.cli import main
except KeyboardInterrupt:
    print("linnet: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
