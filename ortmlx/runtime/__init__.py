"""The runtime: a fused group's device residency and per-call machinery, below the ABI layer (``ep/``) and above
the compiled closures (``compiled/``): device mirrors of ORT buffers written in place (``mirror.py``, a decode
step's all at once: ``kvbatch.py``), result reads (``devread.py``), the host<->device byte counters
(``residency.py``), and ``Group`` (``group.py``), which runs one call on them."""
