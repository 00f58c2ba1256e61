"""report.json and its pages: ``schema`` (load, save and the layout), ``html`` (the HTML report), ``moe`` and ``vl``
(sections for mixture-of-experts and vision-language models)."""
