"""Plans derived from a config before anything loads: what the model costs and where it goes.

    budget.py     bytes per expert and token, working set, caches, KDA state, parameters
    placement.py  one card: what stays resident, what streams per layer, expert slots, s/token
    shards.py     expert parallelism: the plan per rank (`inspect --gpus N`)
"""
