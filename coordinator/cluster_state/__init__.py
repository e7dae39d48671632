"""The cluster's state by concern; coordinator/jobs.py binds it into ClusterState."""
