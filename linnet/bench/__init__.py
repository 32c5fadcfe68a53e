"""``linnet bench``: Linnet's backends and their peers, each in its own process, on one checkpoint.

The parent (``harness``) writes a job file, runs ``python -m linnet.bench.worker JOB SUBJECT`` once per
subject, reads one JSON line back from each, compares every subject's logits with the reference's, and
builds a ``linnet.results.Results``.
"""
