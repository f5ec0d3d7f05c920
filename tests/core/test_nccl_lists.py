"""het_plugin.core.nccl_names.NameFilter against a literal model of NCCL's list matching (property test).

The model below follows NVIDIA/nccl v2.30.7-1 step by step, C string semantics included: src/misc/utils.cc
parseStringList (strtok_r on ',', strsep on ':', snprintf into char prefix[64], atoi of the port, -1 when
absent or empty, entries with an empty name skipped, at most maxList entries), matchIf (strncmp over
strlen(ref) characters, or strlen(string)+1 when exact), matchPort (-1 matches any) and matchIfList (an
empty list matches everything), with the '^' / '=' prefixes read as src/transport/net_ib/init.cc
(NCCL_IB_HCA, MAX_IB_DEVS = 32) and src/os/linux.cc ncclOsFindInterfaces (interfaces: port -1, MAX_IFS = 16)
read them. The package's parser is written differently (Python string operations); they must agree."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from het_plugin.core.nccl_names import NameFilter, nccl_auto_interfaces, socket_ifname_value


# ---- the model: C semantics, one character at a time -------------------------------------------------------

def _cstr(s: str) -> list[str]:
    return list(s) + ["\0"]


def c_strncmp(a: str, b: str, n: int) -> int:
    ca, cb = _cstr(a), _cstr(b)
    for i in range(n):
        x = ca[i] if i < len(ca) else "\0"
        y = cb[i] if i < len(cb) else "\0"
        if x != y:
            return ord(x) - ord(y)
        if x == "\0":
            return 0
    return 0


def c_atoi(s: str) -> int:
    i = 0
    while i < len(s) and s[i] in " \t\n\v\f\r":
        i += 1
    neg = False
    if i < len(s) and s[i] in "+-":
        neg, i = s[i] == "-", i + 1
    v = 0
    while i < len(s) and s[i].isdigit() and s[i] in "0123456789":
        v = v * 10 + (ord(s[i]) - 48)
        i += 1
    return -v if neg else v


def c_strtok_commas(s: str) -> list[str]:
    """strtok_r(str, ",") repeated: maximal runs of non-',' characters."""
    out, cur = [], ""
    for ch in s:
        if ch == ",":
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def c_strsep_colon(rest):
    """strsep(&rest, ":"): (token, rest) with rest None after the last token; token None when rest is None."""
    if rest is None:
        return None, None
    i = rest.find(":")
    return (rest, None) if i < 0 else (rest[:i], rest[i + 1:])


def model_parse(text: str, max_list: int):
    entries = []
    for entry in c_strtok_commas(text):
        if len(entries) >= max_list:
            break
        tok, rest = c_strsep_colon(entry)
        if tok is None or tok == "":
            continue
        prefix = tok[:63]                      # snprintf into char[64]
        tok, rest = c_strsep_colon(rest)
        port = c_atoi(tok) if tok is not None and tok != "" else -1
        entries.append((prefix, port))
    return entries


def model_match(string: str, port: int, entries, exact: bool) -> bool:
    if not entries:
        return True
    for prefix, p in entries:
        n = len(string) + 1 if exact else len(prefix)
        if c_strncmp(string, prefix, n) == 0 and (port == -1 or p == -1 or port == p):
            return True
    return False


def model_selects(env: str, name: str, port: int, max_list: int) -> bool:
    s = env
    search_not = s[:1] == "^"
    if search_not:
        s = s[1:]
    search_exact = s[:1] == "="
    if search_exact:
        s = s[1:]
    return model_match(name, port, model_parse(s, max_list), search_exact) != search_not


# ---- strategies --------------------------------------------------------------------------------------------

NAMES = st.sampled_from(["mlx5_0", "mlx5_1", "mlx5_10", "mlx5_11", "mlx5_2", "mlx4_0", "bnxt_re0", "ib0", "eth0",
                         "eth01", "ens1f0", "enp1s0", "lo", "docker0", "virbr0", " mlx5_0"])
PIECES = st.sampled_from(["mlx5", "mlx5_", "mlx5_1", "mlx5_10", "mlx5_0", "ib", "eth", "eth0", "en", "ens1f0", "bnxt",
                          "lo", ":", "::", ":1", ":2", ":0", ":x", ": 2", ":+1", ":-1", ",", ",,", "^", "=", " ", "1",
                          "a" * 70])
ENV = st.lists(PIECES, min_size=0, max_size=12).map("".join)
LONG = st.lists(st.sampled_from(["mlx5_9", "mlx5_0", ","]), min_size=30, max_size=80).map("".join)


@settings(max_examples=300, deadline=None)
@given(env=st.one_of(ENV, LONG), name=NAMES, port=st.sampled_from([1, 2, 0, 3]))
def test_ib_hca_matches_nccl(env, name, port):
    assert NameFilter.parse(env).selects(name, port) == model_selects(env, name, port, 32), env


@settings(max_examples=300, deadline=None)
@given(env=st.one_of(ENV, LONG), name=NAMES)
def test_socket_ifname_matches_nccl(env, name):
    assert NameFilter.parse(env, ports=False).selects(name) == model_selects(env, name, -1, 16), env


def test_the_cases_the_issue_names():
    assert NameFilter.parse("mlx5_1").selects("mlx5_10", 1)            # prefix: mlx5_1 selects mlx5_10 too
    assert not NameFilter.parse("=mlx5_1").selects("mlx5_10", 1)
    assert NameFilter.parse("^=mlx5_1").selects("mlx5_10", 1) and not NameFilter.parse("^=mlx5_1").selects("mlx5_1", 1)
    assert not NameFilter.parse("=mlx5_0:2").selects("mlx5_0", 1) and NameFilter.parse("=mlx5_0:2").selects("mlx5_0", 2)
    assert not NameFilter.parse("^").selects("mlx5_0", 1)                # '^' alone: nothing (an empty list matches all)
    assert NameFilter.parse("=").selects("mlx5_0", 1)
    assert not NameFilter.parse("mlx5_0:x").selects("mlx5_0", 1)         # atoi('x') = 0: no port 0
    assert not NameFilter.parse(" mlx5_0").selects("mlx5_0", 1)          # nothing is stripped
    assert NameFilter.parse(":1,mlx5_2").tokens == (("mlx5_2", None),)   # an empty name skips the entry


def test_unset_socket_ifname_follows_nccls_order():
    assert nccl_auto_interfaces(["eth0", "ib0", "lo"]) == ["ib0"]
    assert nccl_auto_interfaces(["docker0", "eth0", "lo", "virbr0"]) == ["eth0"]
    assert nccl_auto_interfaces(["lo", "docker0"]) == ["docker0"]
    assert nccl_auto_interfaces(["lo"]) == ["lo"]
    assert socket_ifname_value({"NCCL_SOCKET_IFNAME": "e"}) is None            # strlen(env) > 1 only
    assert socket_ifname_value({"NCCL_SOCKET_IFNAME": "=e"}) == "=e"

