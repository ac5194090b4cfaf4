"""Rewrite docs/CONFIG.md's key rows from `ds-ppo config --describe` (run from the repo root:
`python tests/support/regen_config_doc.py`); prints the keys that have no row yet."""
import re
from pathlib import Path
from ds_ppo.config import describe
doc_path = Path("docs/CONFIG.md"); doc = doc_path.read_text()
described = {}
for line in describe():
    key, rest = line.split(" (default ", 1)
    described[key] = tuple(rest.split("): ", 1))
rows = set(re.findall(r"^\| `([\w.]+)` \|", doc, re.M))
def repl(m):
    key = m.group(1)
    if key not in described: return m.group(0)
    d, text = described[key]
    return f"| `{key}` | `{d}` | {text.replace('|', chr(92) + '|')} |"
doc = re.sub(r"^\| `([\w.]+)` \| `(.*?)` \| (.*) \|$", repl, doc, flags=re.M)
doc_path.write_text(doc)
print("missing rows:", sorted(set(described) - rows), "stale rows:", sorted(rows - set(described)))
