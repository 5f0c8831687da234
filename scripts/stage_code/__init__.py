"""What each dvc.yaml stage's code is and reads, computed from the source (scripts/dvc_lists.py writes it).

- `closure`: the repo files a stage's `promptr1` verb runs (import closure, CLI stage path, modules launched
  by name, package data the code names) and dvc.yaml's stages as DVC renders them.
- `folders`: those files as dep entries, a folder standing for its files where the stage needs all of them.
- `code_index`, `param_reads`: the params keys the stage's reachable code reads.
"""
