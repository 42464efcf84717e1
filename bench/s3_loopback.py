"""A real S3 endpoint on loopback for tests and benchmarks: moto's ThreadedMotoServer (the convention of
the s3fs and zarr test suites), and FaultProxy, an HTTP proxy in front of it that fails a chosen fraction
of requests the ways S3 does: 503 SlowDown, a dropped connection, or a long delay (and 429 Too Many Requests, as
S3-compatible stores throttle)."""
import collections
import http.client
import http.server
import os
import random
import re
import socket
import threading
import time

from infra.distributed import free_port


def dummy_credentials():
    """moto accepts any credentials; set them so that nothing reaches for a real AWS account."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        os.environ[k] = v


class MotoS3:
    """Start/stop a moto S3 server on 127.0.0.1; .endpoint is its URL."""

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
        dummy_credentials()
        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.reset()  # (an earlier server of this process may have left its buckets)

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def upload_dir(self, local_dir, bucket, prefix):
        """Upload a local store directory to s3://bucket/prefix/ (creates the bucket if needed)."""
        c = self.client()
        try:
            c.create_bucket(Bucket=bucket)
        except c.exceptions.BucketAlreadyOwnedByYou:
            pass
        for root, _, files in os.walk(local_dir):
            for f in files:
                path = os.path.join(root, f)
                key = prefix.rstrip("/") + "/" + os.path.relpath(path, local_dir).replace(os.sep, "/")
                c.upload_file(path, bucket, key)
        return f"s3://{bucket}/{prefix.rstrip('/')}"

    def objects(self):
        """{s3://bucket/key: bytes} of every object in every bucket: what all clients have written there."""
        c, out = self.client(), {}
        for b in c.list_buckets()["Buckets"]:
            for page in c.get_paginator("list_objects_v2").paginate(Bucket=b["Name"]):
                for o in page.get("Contents", []):
                    out[f"s3://{b['Name']}/{o['Key']}"] = c.get_object(Bucket=b["Name"], Key=o["Key"])["Body"].read()
        return out

    def reset(self):
        """Empty every bucket. moto keeps its state per process, not per server: without this, what one test module
        wrote would be there for the next module's server too."""
        import urllib.request
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST"), timeout=30)

    def stop(self):
        self.reset()
        self.server.stop()


class SilentEndpoint:
    """An endpoint that takes every connection and never answers (a host behind a black-holing firewall, a hung
    server): a client learns of it only from its own timeouts. .endpoint is its URL."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:  # closed: stop()
                return
            self.conns.append(c)  # (held open, unread, unanswered)

    def stop(self):
        self.sock.close()
        for c in self.conns:
            c.close()


class FaultProxy:
    """HTTP proxy to `upstream` that, for GET requests, answers a fraction `fail` of them with a fault:
    503 SlowDown, a dropped connection (socket closed with no response), or a delay of `delay_s` before
    forwarding, in the proportions of `kinds` ("503", "drop", "delay"; "429": Too Many Requests). Seeded: the
    same requests fail in the same way. Counts what it did in .stats. forbid=True answers every request 403 AccessDenied (a bucket you may not read).
    .signed_by counts the requests by the access key id that signed them (the Credential= of their SigV4
    Authorization header; None: unsigned) and .tokens by their X-Amz-Security-Token (None: none): which
    credentials a client really sent, without looking inside it."""

    def __init__(self, upstream_port, fail=0.1, kinds=("503", "drop", "delay"), delay_s=2.0, seed=0, forbid=False):
        self.upstream_port, self.fail, self.kinds, self.delay_s = upstream_port, fail, kinds, delay_s
        self.forbid = forbid
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.stats = {"requests": 0, "503": 0, "429": 0, "drop": 0, "delay": 0}
        self.signed_by, self.tokens = collections.Counter(), collections.Counter()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _forward(self):
                body = None
                if "Content-Length" in self.headers:
                    body = self.rfile.read(int(self.headers["Content-Length"]))
                fault = None
                signer = re.search(r"Credential=([^/,\s]+)/", self.headers.get("Authorization", ""))
                with proxy.lock:
                    proxy.stats["requests"] += 1
                    proxy.signed_by[signer.group(1) if signer else None] += 1
                    proxy.tokens[self.headers.get("X-Amz-Security-Token")] += 1
                    if self.command == "GET" and proxy.rng.random() < proxy.fail:
                        fault = proxy.rng.choice(proxy.kinds)
                        proxy.stats[fault] += 1
                if proxy.forbid or fault in ("503", "429"):
                    code, msg = {
                        "forbid": (403, b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"),
                        "503": (503, b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
                                     b"</Error>"),
                        "429": (429, b"<Error><Code>TooManyRequests</Code><Message>Too many requests.</Message>"
                                     b"</Error>")}["forbid" if proxy.forbid else fault]
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    if self.command != "HEAD":  # (a body after a HEAD's answer reads as the next answer's start)
                        self.wfile.write(msg)
                    return
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "delay":
                    time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                headers["Host"] = f"127.0.0.1:{proxy.upstream_port}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # a HEAD's answer has no body but the length of the object it describes (what s3fs's info() reads)
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # clients that gave up (timeouts) leave broken pipes behind: expected here

        self.port = free_port()
        self.server = Server(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
