"""Training tools for KVzap surrogates, installed as ``kvzap.train`` behind ``kvzap train`` (``python -m train``).

Which file holds what, from the command line down:

- :mod:`train.__main__`: the command line (argument parsing and dispatch to the modules below).
- :mod:`train.data`: prompts from the Hub (Nemotron sample) or local files.
- :mod:`train.corpus`: an offline corpus from text installed on the machine, held-out sources apart.
- :mod:`train.corpus_files`: each corpus subset's scanner and the readers that turn its files into plain text.
- :mod:`train.collect`: KVzip+ targets from one forward pass of the repeat prompt, sharded and resumable.
- :mod:`train.fit`: ``train fit``: fit, save and report KVzap-Linear / KVzap-MLP (every fitting name importable).
- :mod:`train.surrogate`: one module per layer (ridge or MLP) from tensors or a group of layers at a time.
- :mod:`train.mlp`: KVzap-MLP training with skorch, all layers in one fit, each as if alone.
- :mod:`train.metrics`: held-out R^2, kept-set overlaps and top recalls of predicted log-scores.
- :mod:`train.kinds`: kinds of text of collected rows, evaluation per kind and leave-kinds-out fits.
- :mod:`train.plots`: the figures of a fit's report.
- :mod:`train.ensemble`: several saved surrogates averaged into one checkpoint.
- :mod:`train.gate`: Fast KVzip gates distilled from KVzip scores.

Run ``python -m train --help``.
"""
