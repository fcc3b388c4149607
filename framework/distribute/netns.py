"""Hosts with their own network on one machine: Linux network namespaces.

    with HostNetwork(hosts=2, rate="10gbit") as net:
        net.addresses        # ['10.77.0.1', '10.77.0.2']
        net.prefix(0)        # ['ip', 'netns', 'exec', 'dl0-h0']: runs on host 0
        net.counters()       # {host: (rx_bytes, tx_bytes)} of each host's link

Each host is a namespace with one interface (a veth pair) and its own
address; the pairs' other ends meet at a bridge in a hub namespace, so the
machine's own network is not touched. With `rate`, each link is shaped in
both directions with a token bucket (`tc qdisc ... tbf`): a full-duplex
link of that bandwidth, with no added delay. Needs root, `ip` and `tc`;
`missing()` says what is absent. No TensorFlow here.
"""

import json
import os
import shutil
import subprocess

from framework.distribute.config import LaunchConfig
from framework.errors import ConfigError
from framework.settings import default

SUBNET = "10.77.0"


def missing():
  """Why namespaces cannot be made here (a short reason), or None."""
  if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
    return "not Linux (no network namespaces)"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"no `{tool}` command (iproute2)"
  if os.geteuid() != 0:
    return "not root (network namespaces need CAP_NET_ADMIN)"
  return None


def _run(*argv):
  proc = subprocess.run(argv, capture_output=True, text=True)
  if proc.returncode:
    raise ConfigError(f"`{' '.join(argv)}` failed: "
                      f"{proc.stderr.strip() or proc.returncode}")
  return proc.stdout


def _burst_bytes(rate_bits):
  # The bucket must hold a GSO packet (64 KiB) and about 2 ms at the rate,
  # or the shaper caps below the rate on a busy machine.
  return max(256 * 1024, int(rate_bits / 8 * 0.002))


def parse_rate(rate):
  """Bits per second of `rate` ('10gbit', '500mbit', '1e9'), or None."""
  if rate in (None, "", "none", "unshaped"):
    return None
  text = str(rate).strip().lower()
  for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3),
                        ("bit", 1.0)):
    if text.endswith(suffix):
      text, factor = text[:-len(suffix)], scale
      break
  else:
    factor = 1.0
  try:
    value = float(text) * factor
  except ValueError:
    value = -1
  if not value > 0:
    raise ConfigError(f"netns_rate={rate!r} is not a bandwidth: use e.g. "
                      "'10gbit', '500mbit' (or '' for unshaped)")
  return value


class HostNetwork:
  """`hosts` namespaces on one bridge; a context manager (removes them).

  Args:
    hosts: how many hosts (namespaces), 1..250.
    rate: each link's bandwidth ('10gbit', ...; None: unshaped).
    name: prefix of the namespace and interface names (short: Linux allows
      15 characters per interface name).
    mtu: every link's MTU in bytes (1500: Ethernet's default; 9000: the
      jumbo frames of many data-centre networks, fewer packets per byte).
  """

  def __init__(self, hosts, rate=None, name="dl0",
               mtu=default(LaunchConfig, "netns_mtu")):
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not (
        0 < hosts <= 250):
      raise ConfigError(f"hosts={hosts!r} must be an integer in 1..250")
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not (
        576 <= mtu <= 65535):
      raise ConfigError(f"mtu={mtu!r} must be an integer in 576..65535 "
                        "(1500: Ethernet, 9000: jumbo frames)")
    self.mtu = mtu
    reason = missing()
    if reason:
      raise ConfigError(f"cannot make network namespaces: {reason}")
    self.hosts = hosts
    self.rate_bits = parse_rate(rate)
    self.name = name
    self.hub = f"{name}-hub"
    self.namespaces = [f"{name}-h{i}" for i in range(hosts)]
    self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
    self._made = []

  def _host_link(self, i):
    return f"{self.name}h{i}"

  def _hub_link(self, i):
    return f"{self.name}b{i}"

  def __enter__(self):
    try:
      self._setup()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()

  def _setup(self):
    existing = _run("ip", "netns", "list")
    for ns in [self.hub] + self.namespaces:
      if ns in existing.split():
        # Left by a run that was killed: ours to clean.
        _run("ip", "netns", "del", ns)
      _run("ip", "netns", "add", ns)
      self._made.append(ns)
      _run("ip", "-n", ns, "link", "set", "lo", "up")
    _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", self.hub, "link", "set", "br0", "up")
    for i, ns in enumerate(self.namespaces):
      host, hub = self._host_link(i), self._hub_link(i)
      _run("ip", "link", "add", host, "mtu", str(self.mtu), "netns", ns,
           "type", "veth", "peer", "name", hub, "mtu", str(self.mtu),
           "netns", self.hub)
      _run("ip", "-n", self.hub, "link", "set", hub, "master", "br0", "up")
      _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev",
           host)
      _run("ip", "-n", ns, "link", "set", host, "up")
      if self.rate_bits:
        for where, dev in ((ns, host), (self.hub, hub)):
          _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", f"{int(self.rate_bits)}bit", "burst",
               str(_burst_bytes(self.rate_bits)), "latency", "50ms")

  def close(self):
    """Removes the namespaces (and with them every interface)."""
    for ns in reversed(self._made):
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    self._made = []

  def prefix(self, host):
    """argv prefix that runs a command on `host`."""
    return ["ip", "netns", "exec", self.namespaces[host]]

  def counters(self):
    """{host: (rx_bytes, tx_bytes)} of each host's interface."""
    result = {}
    for i, ns in enumerate(self.namespaces):
      [link] = json.loads(_run("ip", "-n", ns, "-s", "-j", "link", "show",
                               "dev", self._host_link(i)))
      stats = link.get("stats64") or link["stats"]
      result[i] = (stats["rx"]["bytes"], stats["tx"]["bytes"])
    return result
