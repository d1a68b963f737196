"""Real redis-server processes for the remote-tier Python tests, started on
free loopback ports in the test's temporary directory and killed by the
caller (a standalone server, optionally with TLS or ACL users; a 3-master
Redis Cluster made with redis-cli --cluster create).  Certificates for TLS
tests are generated with the openssl CLI.  Nothing here downloads anything.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time


def run_node(module: str, func: str, *args) -> None:
    """Runs module.func(*args) (literals only) in a child process - another
    node with its own cache directory - and fails the test if it fails."""
    import sys
    code = ("import sys; sys.path.insert(0, %r); import %s as t; t.%s(*%r)"
            % (os.path.dirname(os.path.abspath(__file__)), module, func, args))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=os.environ.copy())
    assert p.returncode == 0, p.stdout + p.stderr


def tier_or_skip(make, *args, **kw):
    """make(*args, **kw) - a tier with a remote URL - or skip the test when
    libkvtier was built without Redis support."""
    import pytest
    try:
        return make(*args, **kw)
    except Exception as e:
        if "no Redis support" in str(e):
            pytest.skip("libkvtier built without hiredis")
        raise


def have_redis() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def free_port(bus: bool = False) -> int:
    """A free port (with port + 10000 free too when bus: the cluster bus)."""
    for _ in range(200):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        s.close()
        if not bus:
            return p
        if p + 10000 > 65535:
            continue
        b = socket.socket()
        try:
            b.bind(("127.0.0.1", p + 10000))
            return p
        except OSError:
            continue
        finally:
            b.close()
    raise RuntimeError("no free port")


def _wait_port(port: int) -> None:
    for _ in range(400):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            return
        except OSError:
            time.sleep(0.025)
    raise RuntimeError(f"redis-server on port {port} did not start")


def start(dirpath: str, *extra: str, port: int | None = None,
          tls_port: int | None = None) -> tuple[subprocess.Popen, int]:
    """Starts redis-server in dirpath; returns (process, port).  With
    tls_port, port 0 disables plain TCP and the TLS port is waited for."""
    os.makedirs(dirpath, exist_ok=True)
    if port is None:
        port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", dirpath, "--logfile", "redis.log"]
    if tls_port is not None:
        args += ["--tls-port", str(tls_port)]
    proc = subprocess.Popen(args + list(extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_port(tls_port if tls_port is not None and port == 0 else port)
    except RuntimeError:
        proc.kill()
        proc.wait()
        raise
    return proc, port


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def cluster(dirpath: str, certs: dict | None = None) -> tuple[list, str]:
    """Three masters, no replicas; returns (processes, seed URL).  With certs
    (make_certs): TLS only - clients, the cluster bus and the announced ports
    (tls-cluster yes) - and a rediss:// URL."""
    procs, ports = [], []
    tls, cli_tls = [], []
    if certs:
        tls = ["--tls-cert-file", certs["srv.crt"], "--tls-key-file", certs["srv.key"],
               "--tls-ca-cert-file", certs["ca.crt"], "--tls-cluster", "yes",
               "--tls-auth-clients", "no"]
        cli_tls = ["--tls", "--cacert", certs["ca.crt"]]
    try:
        for i in range(3):
            port = free_port(bus=True)
            while port in ports:
                port = free_port(bus=True)
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"] + tls
            if certs:
                p, _ = start(os.path.join(dirpath, f"n{i}"), *extra, port=0,
                             tls_port=port)
            else:
                p, _ = start(os.path.join(dirpath, f"n{i}"), *extra, port=port)
            procs.append(p)
            ports.append(port)
        r = subprocess.run(["redis-cli", *cli_tls, "--cluster", "create"]
                           + [f"127.0.0.1:{p}" for p in ports]
                           + ["--cluster-replicas", "0", "--cluster-yes"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"cluster create failed: {r.stdout}{r.stderr}")
        for _ in range(400):
            ok = all("cluster_state:ok" in subprocess.run(
                ["redis-cli", *cli_tls, "-p", str(p), "cluster", "info"],
                capture_output=True, text=True).stdout for p in ports)
            if ok:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("cluster did not reach cluster_state:ok")
    except BaseException:
        stop(procs)
        raise
    scheme = "rediss://" if certs else "redis://"
    return procs, scheme + ",".join(f"127.0.0.1:{p}" for p in ports)


def make_certs(d: str) -> dict:
    """A CA, a server certificate for 127.0.0.1 (IP SAN) and a client
    certificate, signed by it; plus an unrelated CA.  Paths by name."""
    os.makedirs(d, exist_ok=True)
    f = {k: os.path.join(d, k) for k in
         ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt", "cli.key", "cli.csr",
          "cli.crt", "other.key", "other.crt", "ext.cnf")}

    def ossl(*a):
        subprocess.run(["openssl", *a], check=True, capture_output=True)

    for ca in ("ca", "other"):
        ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", f"/CN=kvtier test {ca}", "-keyout", f[f"{ca}.key"],
             "-out", f[f"{ca}.crt"])
    with open(f["ext.cnf"], "w") as fh:
        fh.write("subjectAltName=IP:127.0.0.1\n")
    for who, cn in (("srv", "127.0.0.1"), ("cli", "kvtier client")):
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
             "-keyout", f[f"{who}.key"], "-out", f[f"{who}.csr"])
        ext = ["-extfile", f["ext.cnf"]] if who == "srv" else []
        ossl("x509", "-req", "-in", f[f"{who}.csr"], "-CA", f["ca.crt"], "-CAkey",
             f["ca.key"], "-CAcreateserial", "-days", "2", "-out", f[f"{who}.crt"], *ext)
    return f
