"""What held the embedded server's generation or its connection slots (issue 40, "partly held"):
a hostile weight payload decoded on the engine thread, requests generated after their clients left,
connections trickling bodies filling every slot so that /health was 503.

No timing assertions: each test checks what was generated, aborted or answered, with generous deadlines."""
from __future__ import annotations

import base64
import socket
import sys
import threading
import time

import pytest

from engine_helpers import BYTEARRAY_CALL, http, save_tiny_qwen2

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny")))


def _server(tmp_path, model_dir, *flags):
    from megaforge.rollout.http.processes import ServerProcess
    from megaforge.supervise import child_env

    cmd = lambda port, fd: [sys.executable, "-m", "megaforge.rollout.server", "--model", model_dir,  # noqa: E731
                            "--port", str(port), "--sock-fd", str(fd), *flags]
    return ServerProcess("engine_0", cmd, str(tmp_path / "engine.log"), env=child_env(), hold_socket=True).start_ready(120)


def _info(url) -> dict:
    return http(url, "GET", "/server_info", timeout=30)[1]


def _wait(url, pred, what: str, deadline_s: float = 60.0) -> dict:
    end = time.time() + deadline_s
    while time.time() < end:
        info = _info(url)
        if pred(info):
            return info
        time.sleep(0.02)
    raise AssertionError(f"not within {deadline_s:g} s: {what}; server_info: {_info(url)}")


def _post_raw(port: int, path: str, body: bytes, send_body: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
              .encode() + (body if send_body else body[:1]))
    return s


def test_a_hostile_weight_payload_is_decoded_off_the_engine_thread(model_dir, tmp_path):
    """The engine thread is held by a request (--generate-delay 60); a hostile pickle is refused (400
    naming the field) while that request is still running: its decoding did not wait for, or hold, the
    engine thread (before: it ran there, queued behind the request). The opcode bound that refuses a
    flood of EMPTY_LIST opcodes is tests/sync/test_unpickler.py's (a 1 MB flood takes seconds to parse)."""
    s = _server(tmp_path, model_dir, "--generate-delay", "60")
    try:
        held = _post_raw(s.port, "/generate", b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}')
        _wait(s.url, lambda i: i["running_requests"] == 1, "the held request runs")
        assert http(s.url, "POST", "/begin_weight_update", {})[0] == 200
        evil = base64.b64encode(BYTEARRAY_CALL).decode()
        st, out = http(s.url, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [evil]}, timeout=45)
        assert st == 400 and out["param"] == "serialized_named_tensors", (st, out)
        assert "builtins.bytearray" in out["message"], out
        assert _info(s.url)["running_requests"] == 1  # answered while the engine thread was still held
        held.close()
    finally:
        s.stop(grace_s=1.0)  # the engine thread sleeps out its delay: no graceful exit to wait for


@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    s = _server(tmp_path_factory.mktemp("srv"), model_dir, "--generate-delay", "1", "--max-connections", "40",
                "--body-timeout", "120")
    yield s
    s.stop(grace_s=2.0)


def test_requests_whose_clients_left_are_not_generated(srv):
    """One running and five queued requests whose clients close their connections, then a 1-token
    request: once it is answered every earlier batch has been through the engine thread (one at a
    time, in order), and only it was generated; the six were dropped, or aborted if the first had
    started decoding (500 tokens: it cannot finish first). Before: all seven were generated, the last
    one waiting for the others."""
    before = _info(srv.url)
    body = b'{"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 500, "ignore_eos": true}}'
    running = _post_raw(srv.port, "/generate", body)
    _wait(srv.url, lambda i: i["running_requests"] == 1, "the first request runs")
    queued = [_post_raw(srv.port, "/generate", body) for _ in range(5)]
    _wait(srv.url, lambda i: i["queued_requests"] == 5, "five requests queued")
    for sk in [running] + queued:
        sk.close()
    _wait(srv.url, lambda i: i.get("abandoned_requests", 0) - before.get("abandoned_requests", 0) == 6,
          "six requests abandoned")
    st, out = http(srv.url, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
    assert st == 200 and len(out["output_ids"]) == 1, out
    after = _info(srv.url)
    assert after["served_requests"] - before["served_requests"] == 1, (before, after)


def test_connections_trickling_bodies_leave_health_200(srv):
    """40 connections (the limit) each send a request head and one byte of a 1,000-byte body. At most
    a quarter of the limit (10) may be reading bodies: the other 30 get a 503 at once and their slots
    free; /health and a request whose body arrives with its head still get through (before: all 40
    held a slot until --body-timeout and a new connection got 503)."""
    body = b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}'.ljust(1000)
    socks = [_post_raw(srv.port, "/generate", body, send_body=False) for _ in range(40)]
    try:
        refused = 0
        end = time.time() + 60
        pending = list(socks)
        while pending and refused < 30 and time.time() < end:
            for sk in list(pending):
                sk.settimeout(0.05)
                try:
                    head = sk.recv(4096)
                except socket.timeout:
                    continue
                pending.remove(sk)
                refused += head.startswith(b"HTTP/1.1 503")
        assert refused == 30, f"{refused} of the 40 trickling requests refused"
        assert http(srv.url, "GET", "/health", timeout=30)[0] == 200
        info = _info(srv.url)
        assert info["body_readers"] == 10 and info["refused_body_readers"] >= 30, info
        # a request whose body comes with its head does not wait as a reader: served while the 10 trickle
        assert http(srv.url, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})[0] == 200
        # nor does one whose body lags its head by a moment (a busy client, head and body in two writes): before,
        # a body not read with its head counted as trickling and got the 503 (seen on a loaded CI machine)
        late = b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}'
        sk = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        sk.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(late)}\r\nConnection: close\r\n\r\n".encode())
        time.sleep(0.3)
        sk.sendall(late)
        socks.append(sk)
        assert sk.recv(4096).startswith(b"HTTP/1.1 200"), "a body 0.3 s behind its head was refused"
    finally:
        for sk in socks:
            sk.close()
    _wait(srv.url, lambda i: i["body_readers"] == 0, "the trickling readers end with their connections")
