"""
Throttling: the answers with which S3 (or an S3-compatible store) asks a client for fewer requests, how a failure is
known to be one, and how they are said and counted. infra/reader.py's Backoff retries them; the rate S3 documents,
and a run's GET/s against it, are the planner's (infra/plan.py: S3_GET_PER_PREFIX, the dry run's warning).
"""

import collections
import sys

# S3's 503 SlowDown, the codes botocore's standard retry mode takes as throttling (botocore/retries/standard.py),
# and 429 Too Many Requests, which S3-compatible stores send
CODES = frozenset((
    "SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottledException", "TooManyRequestsException", "TooManyRequests", "RequestLimitExceeded",
    "RequestThrottled", "BandwidthLimitExceeded", "ProvisionedThroughputExceededException"))
CAP_S = 20.0  # the longest backoff after a throttling answer (botocore's standard mode caps at 20 s too)
# how long one request may be throttled without a break before it is an error: S3 answers SlowDown until it has
# partitioned a hot prefix, which takes minutes, so a few seconds of retries (read_retries, for faults) would stop a
# run that S3 is about to serve; a run whose request rate S3 never takes must still stop, and say why
PATIENCE_S = 600.0
COUNT = collections.Counter()  # throttling answers in this process, by store (or listing)


def answer(exc):
    """The throttling answer behind failure exc, e.g. 'SlowDown (HTTP 503)', or None. s3fs turns botocore's
    ClientError into an OSError (EBUSY for SlowDown) whose __cause__ is that ClientError, with the code and the HTTP
    status in its .response; aiohttp's answer errors (fsspec's http://) carry .status."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        resp = getattr(exc, "response", None)
        if isinstance(resp, dict):
            code = str((resp.get("Error") or {}).get("Code") or "")
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code in CODES or code in ("429", "503") or status in (429, 503):
                return f"{code or 'no code'} (HTTP {status})" if status else code
        if getattr(exc, "status", None) in (429, 503):
            return f"HTTP {exc.status}"
        exc = exc.__cause__ or exc.__context__
    return None


def note(where, endpoint, code):
    """Count a throttling answer of `where` (a store: the part before ' ('); a line on stderr at its first, then at
    its 10th, 100th, ...: said, and counted, without a line per request."""
    key = where.split(" (")[0]
    COUNT[key] += 1
    n = COUNT[key]
    if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
        print(f"WARNING: {key} at {endpoint}: throttled ({code}), {n:,} answer{'s' * (n > 1)} so far: backing off "
              f"with jitter and going on (this rank asks less often while it lasts); the run's GET/s per S3 prefix "
              f"against S3's documented rate, and what lowers it: DRY_RUN=1 bash launch.sh CONFIG", file=sys.stderr,
              flush=True)


def message(what, endpoint, code, tries, seconds):
    """What a request throttled for longer than PATIENCE_S says (the reader raises it as a DataError)."""
    from infra.plan import S3_GET_PER_PREFIX  # (here, not at the top: the reader need not import the planner)
    return (f"{what}: throttled for {seconds:.0f} s without a break ({code}, {tries} answers in a row from "
            f"{endpoint}): more requests reach its prefix than it takes (S3 documents {S3_GET_PER_PREFIX:,} GET/s per partitioned "
            f"prefix); the dry run (DRY_RUN=1 bash launch.sh CONFIG) prints the run's GET/s and what lowers them: "
            f"larger chunks, align_crops=True, stores spread over prefixes (docs/data.md)")
