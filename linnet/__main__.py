import sys

try:  # Ctrl-C while Linnet itself is still importing is one line too
    from linnet.cli import entry
except KeyboardInterrupt:
    print("linnet: interrupted", file=sys.stderr)
    sys.exit(130)

entry()
