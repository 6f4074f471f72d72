"""Scale-out past one GPU: cosystream on Ray Serve (docs/scaling.md).

`load` is plain Python (what a replica reports, how replicas are ranked, how metrics are merged);
`ray_app` needs the optional `ray[serve]` extra (`pip install cosystream[ray]`) and is imported only by
`cosystream serve --replicas N` and `serve run`.
"""
