"""The feature store stage: Feast over the data stage's per-document features.

    apply_repo(ws, cfg); publish_offline(ws, v); materialize(ws, cfg)   # components.features.store / .offline
    select_training_set(ws, v, cfg)                                    # components.features.selection
    online_features(ws, cfg, ids)                                      # components.features.online
"""
