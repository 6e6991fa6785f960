{{- define "llamaft.name" -}}llamaft-operator{{- end -}}

{{- define "llamaft.labels" -}}
app.kubernetes.io/name: llamaft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "llamaft.selectorLabels" -}}
app.kubernetes.io/name: llamaft
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The rules the operator needs: exactly the calls in operator/llamaft/operator/kube.py and kopf's own (tests compare). */}}
{{- define "llamaft.rules" -}}
- apiGroups: ["llamaft.io"]
  resources: ["llamafinetunes"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["llamaft.io"]
  resources: ["llamafinetunes/status"]
  verbs: ["get", "patch"]
- apiGroups: ["kubeflow.org"]
  resources: ["pytorchjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["trainer.kubeflow.org"]
  resources: ["trainjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors", "prometheusrules"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}


{{/* Several replicas peer (kopf --peering) through this object; one replica runs standalone. */}}
{{- define "llamaft.peered" -}}{{ if gt (int .Values.replicas) 1 }}true{{ end }}{{- end -}}
{{- define "llamaft.peeringName" -}}{{ include "llamaft.name" . }}-{{ .Release.Namespace }}{{- end -}}

{{/* kopf's own calls for its peering (operator/llamaft/operator/peering.py; tests compare). */}}
{{- define "llamaft.clusterPeeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end -}}
{{- define "llamaft.namespacedPeeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end -}}
