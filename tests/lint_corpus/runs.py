RUNS = {}
