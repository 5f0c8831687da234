"""MLflow: the stages' runs (`runs`), traces (`traces`), links between runs (`links`), the registry's version
lineage and retention (`lineage`), the champion rule (`promotion`) and the headline figures (`headline`)."""
