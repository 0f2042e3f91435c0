"""A rendezvous store that no dead worker of an earlier attempt has written in.

When torchrun restarts the workers (a failure, a node that rejoins), the new ones must not read
keys the old ones left (a finished barrier, say). Two launch paths, one rule:
- under the node launcher, every rendezvous round gets a fresh store, served by that round's
  rank 0 (`FRESH_STORE_ENV`, which the launcher puts in torchrun's environment);
- under a plain torchrun, the workers share the agent's long-lived store, and prefix their keys
  with the restart count (`store_prefix`). That count is one node's, though, and a node restarted
  because another one rejoined does not count it (torch's "membership changes do not count as
  retries"), so restarts across nodes need the launcher.
Imports nothing heavy: the launcher uses it before torch is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping

FRESH_STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def store_prefix(env: Mapping[str, str]) -> str:
    """The key prefix of this attempt's workers: none with a store of their own."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        return ""
    return f"attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
