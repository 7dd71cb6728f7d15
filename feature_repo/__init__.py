"""The Feast feature repo lmforge applies (feature_store.yaml + feature_definitions.py), as package data.

Feast skips __init__.py when it imports a repo's files; this one only makes the folder a
package, so that the installed wheel carries it (see components/features/store.py).
"""
