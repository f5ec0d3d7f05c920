"""A rank that does one scripted thing, for the launcher's own tests (integration_tests/test_launcher.py).

HET_TEST_DO (per rank), steps joined by ";":
  sleep:S               sleep S seconds
  exit:CODE             exit with CODE
  kill                  SIGKILL itself
  flood:OUT:ERR         write OUT bytes to stdout and ERR bytes to stderr (one line of 'x' per 64 KiB)
  touch:PATH            create PATH
  await:PATH:S          wait up to S seconds for PATH to exist; exit 7 if it never does
  child:S               start a child (same session, same stdout/stderr) that sleeps S s; print its pid
"""
import os
import signal
import subprocess
import sys
import time


def flood(stream, nbytes: int) -> None:
    line = "x" * 65535 + "\n"
    while nbytes > 0:
        chunk = line[-nbytes:] if nbytes < len(line) else line
        stream.write(chunk)
        nbytes -= len(chunk)
    stream.flush()


def main() -> int:
    for step in filter(None, os.environ.get("HET_TEST_DO", "").split(";")):
        what, *arg = step.split(":")
        if what == "sleep":
            time.sleep(float(arg[0]))
        elif what == "exit":
            print(f"rank {os.environ['RANK']} exits with {arg[0]}", file=sys.stderr, flush=True)
            return int(arg[0])
        elif what == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif what == "flood":
            flood(sys.stdout, int(arg[0]))
            flood(sys.stderr, int(arg[1]))
        elif what == "touch":
            open(arg[0], "w").close()
        elif what == "await":
            end = time.monotonic() + float(arg[1])
            while not os.path.exists(arg[0]):
                if time.monotonic() > end:
                    print(f"{arg[0]} never appeared", file=sys.stderr, flush=True)
                    return 7
                time.sleep(0.05)
        elif what == "child":
            child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({float(arg[0])})"])
            print(f"CHILD {child.pid}", flush=True)
        else:
            raise SystemExit(f"unknown step {step!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
