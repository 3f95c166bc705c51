"""The benchmarks behind the committed results, run from the repository root as modules:

    python -m benchmarks.decode --out OUT          # one script per measurement; --help says what each measures

Every script imports only ``kascade`` and ``benchmarks.common`` (timing, logging, output folders, shared inputs); no
script imports another. The figures the README and the manual quote are curated from their outputs into
``src/kascade/results/`` (one file per card, one for accuracy); ``python -m benchmarks.tables`` renders the tables
the documentation shows from those files.
"""
