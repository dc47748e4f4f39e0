"""Training scripts for KVzap surrogates (not part of the installed package).

- :mod:`train.collect`: KVzip+ targets from one forward pass of the repeat prompt, sharded and resumable.
- :mod:`train.data`: prompts from the Hub (Nemotron sample) or local files.
- :mod:`train.corpus`: an offline corpus from text installed on the machine, held-out sources apart.
- :mod:`train.fit`: KVzap-Linear (ridge) and KVzap-MLP (skorch) per layer, held-out R^2.

Run ``python -m train --help``.
"""
