"""The embedded offline training corpus (public-domain Shakespeare plays) and the script that builds it."""
