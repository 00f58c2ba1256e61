"""report.json and its pages: ``schema`` (the typed :class:`~.schema.Report`, load, save and the layout), ``validate``
(the checks on a read report), ``html`` (the HTML report), ``plots`` (its data reductions and figures), ``moe`` and
``vl`` (sections for mixture-of-experts and vision-language models)."""
