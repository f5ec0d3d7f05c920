"""One TCP transfer for the emulator tests: ``serve ADDR PORT`` prints the goodput it received;
``send ADDR PORT SECONDS MBIT`` sends for about SECONDS at most MBIT worth of data."""
import json
import socket
import sys
import time


def serve(addr: str, port: int) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(1)
    print("READY", flush=True)
    s.settimeout(30)
    conn, _ = s.accept()
    total, first = 0, None
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        if first is None:
            first = time.monotonic()
            continue            # the first chunk rides the shaper's initial burst; time from here on
        total += len(data)
    elapsed = time.monotonic() - first
    print("RESULT " + json.dumps({"mbit_per_s": total * 8 / elapsed / 1e6, "bytes": total, "seconds": elapsed}),
          flush=True)


def send(addr: str, port: int, seconds: float, mbit: float) -> None:
    nbytes = int(seconds * mbit * 1e6 / 8)
    s = socket.create_connection((addr, port), timeout=10)
    chunk = b"\0" * 65536
    sent = 0
    while sent < nbytes:
        s.sendall(chunk)
        sent += len(chunk)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    s.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
