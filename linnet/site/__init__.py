"""The Nestmodels site: static pages rendered from the registry and results files."""
