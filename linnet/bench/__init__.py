"""``linnet bench``: Linnet's backends and their peers, each in its own process, on one checkpoint.

The parent (``harness``) writes a job file, starts ``python -m linnet.bench.worker JOB SUBJECT`` for
every subject, has them take turns one generation at a time (JSON lines both ways), compares every
subject's logits with the reference's, and builds a ``linnet.results.Results``.
"""
