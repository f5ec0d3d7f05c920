import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The integration tests are not about issue 32's launch refusal: they plan with every node they launch, as before
# (tiny models on 2-4 node clusters would otherwise be planned over node subsets). Every rank and tool they start
# inherits it; support/launch.py sets it too, for rank scripts started outside pytest.
os.environ.setdefault("HET_PLUGIN_USE_ALL_NODES", "1")
