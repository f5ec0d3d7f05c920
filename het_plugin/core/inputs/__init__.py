"""What the planner reads: cluster, catalog, model, profile (and its file schema); YAML in, ConfigError out.
"""
